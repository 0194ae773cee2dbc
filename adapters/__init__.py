"""Channel adapters: each turns one platform's transport into ``InboundEvent``s for
``runtime.admit`` and sends the runtime's replies back (:class:`prismd.channel.ChannelAdapter`).

* :mod:`adapters.telegram` — the Bot API, long polling or webhook;
* :mod:`adapters.webchat` — the local web chat: an HTTP page and a WebSocket on one port;
* :mod:`adapters.signal` — signal-cli over JSON-RPC (its connection kind; not built yet);
* :mod:`adapters.toolkit` — what adapters share: HTTP/1.1 over h11, the receiver lease,
  backoff, the JSON-RPC client;
* :mod:`adapters.kinds` — the registry of connection kinds the daemon's config and wiring
  read.
"""

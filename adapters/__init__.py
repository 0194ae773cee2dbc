"""Channel adapters: each turns one platform's transport into ``InboundEvent``s for
``runtime.admit`` and sends the runtime's replies back (:class:`prismd.channel.ChannelAdapter`).

* :mod:`adapters.telegram` — the Bot API, long polling or webhook;
* :mod:`adapters.webchat` — the local web chat: an HTTP page and a WebSocket on one port;
* :mod:`adapters.toolkit` — what adapters share: the HTTP/1.1 request-head reader and responder.
"""

"""What the tests share: one fake clock of each kind, one set of builders (identity, grant,
event), one recording host over a real runtime, one set of store backends, the scriptable
agent, and the recording ``admit`` of the adapter tests.

* :mod:`.clocks` — :class:`TrioClock` (follows Trio's virtual time, so leases expire under
  ``autojump_clock``) and :class:`ManualClock` (moved by hand);
* :mod:`.builders` — :func:`identity`, :func:`grant`, :func:`event` with the behaviours list's
  common fixture (connection ``tg-1``, chat ``chat-1``, actor ``user-1``, tenant ``tenant-1``);
* :mod:`.harness` — :class:`Host`, the host side of a runtime (authorize, resolve_agent,
  deliver, all recording), :func:`runtime` / :func:`open_harness` to run one, and
  :func:`store_factory` for "restart = reopen the same journal";
* :mod:`.backends` — :class:`Backend` and :data:`BACKENDS`: memory, SQLite and PostgreSQL;
* :mod:`.scripted` — :class:`ScriptedAgent`, the agent that stands in for a provider;
* :mod:`.recorder` — :class:`Recorder`, an ``admit`` that records what an adapter admits;
* :mod:`.waiting`, :mod:`.flood` — waiting for a condition; floods of raw connections;
* :mod:`.handler_server` — a loopback HTTP server answering with a test's handler;
* :mod:`.spreader` — the loopback load spreader in front of several ``prismd run``;
* :mod:`.pgserver`, :mod:`.privileges` — the PostgreSQL test server; what needs root.
"""

"""The control socket's settings (the ``[control]`` table) and its operators: records only;
:mod:`prismd.daemon` reads them from the config file and hands them to :func:`serve_control`."""

from __future__ import annotations

import attrs


@attrs.frozen
class Operator:
    """An operator identity for one local uid, scoped to a tenant (and optionally more)."""

    uid: int
    tenant: str = "default"
    account: str | None = None
    user: str | None = None


@attrs.frozen
class ControlConfig:
    socket: str = "var/run/control.sock"
    group: str | None = None
    operators: tuple[Operator, ...] = ()
    max_request_bytes: int = 65536
    idle_timeout_ms: int = 30000

    def operator_for(self, uid: int, *, daemon_uid: int | None = None) -> Operator | None:
        """The operator for ``uid``, or ``None`` when that uid may not use the socket.

        The uid running the daemon is always an operator for tenant ``"default"`` unless
        it is listed explicitly (then its listed scope wins).
        """
        for operator in self.operators:
            if operator.uid == uid:
                return operator
        if daemon_uid is not None and uid == daemon_uid:
            return Operator(uid=uid)
        return None

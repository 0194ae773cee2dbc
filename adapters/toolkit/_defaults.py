"""What a channel adapter answers for the features it does not offer (see
:class:`prismd.channel.AdapterFeatures`): one place for those answers, so an adapter holds
only what its platform does."""

from __future__ import annotations

import trio

from prismd.channel import (
    FILES_UNSUPPORTED,
    AttachmentRef,
    OutboundFile,
    Preview,
    Reply,
    SendResult,
)

__all__ = ["AdapterDefaults"]


class AdapterDefaults:
    """The :class:`prismd.channel.ChannelAdapter` methods of an adapter that offers no
    previews, no attachments and no files, and holds nothing outside ``run``. An adapter
    that offers one of them overrides its method."""

    __slots__ = ()

    def send_draft(self, preview: Preview) -> None:
        """No previews (``features.previews`` is false): nothing is shown."""
        return None

    async def fetch_attachment(self, ref: AttachmentRef) -> None:
        """No attachments (``features.attachments`` is false): always ``None``."""
        await trio.lowlevel.checkpoint()

    async def send_file(self, reply: Reply, file: OutboundFile) -> SendResult:
        """No files (``features.max_file_bytes`` is 0): refused, ``files_unsupported``."""
        await trio.lowlevel.checkpoint()
        return FILES_UNSUPPORTED

    async def aclose(self) -> None:
        """Nothing is held outside ``run``."""
        await trio.lowlevel.checkpoint()

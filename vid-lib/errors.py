"""Exception types, one per domain. Messages say what is wrong, the limit and the fix."""


class VfabError(Exception):
    """Base of every error vfab raises on purpose."""


class VidError(VfabError, ValueError):
    """A VID, key, service id or range is malformed or out of bounds."""


class FrameError(VfabError, ValueError):
    """A vfab frame could not be parsed (truncated, wrong version, bad length)."""


class RegistryError(VfabError):
    """etcd is unreachable or holds something vfab cannot use."""


class NotFound(RegistryError):
    """A service, endpoint or range named by the caller does not exist."""


class Conflict(RegistryError):
    """A transaction lost: somebody changed the same ranges first (epoch moved)."""


class Compacted(RegistryError):
    """A watch asked for revisions etcd has compacted away (it keeps a bounded history): read the keys
    again and watch from there."""


class MemberDown(RegistryError):
    """The etcd member in use failed under a watch (it died, or has no leader): the client moved on to another
    member, where the watch resumes from its next revision."""


class TransportError(VfabError):
    """A raw socket could not be opened, bound or filtered."""


class StateError(VfabError):
    """A state operation (split/merge/mirror/move) was refused or failed; the message says why and what to do."""

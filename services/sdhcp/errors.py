"""The one exception type of sdhcp (STYLE.md item 7: one per domain)."""

from vfab.vid.errors import VfabError


class DhcpError(VfabError, ValueError):
    """A DHCP message or its IPv4/UDP frame is malformed, or a reply breaks RFC 2131; the message says which."""

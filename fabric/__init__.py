"""fabric: Open vSwitch side — OVSDB bridges/ports, the flow compiler, flow specs."""

"""cli: the ``vfab`` command (click). One module per group of subcommands."""

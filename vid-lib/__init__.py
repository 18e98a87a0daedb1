"""vid-lib: VID codec, range algebra, etcd schema, frame format and the service API."""

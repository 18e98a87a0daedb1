"""controller: the os-ken route controller (etcd → compiled flows → atomic bundles)."""

"""memcached-helper: PostMan helpers for an unmodified memcached (DESIGN.md §6, issue 8).

The fast path is the DPDK program in ``dpdk/`` (``make -C services/memcached-helper/dpdk helper``);
``mcudp`` is the memcached UDP client side (tests, benchmarks), ``topo`` a namespace topology that runs
clients, memcached and one helper for real.  On the fabric: ``agent`` runs and announces memcached and
each helper, ``control`` switches helpers in and out of ranges (``vfab helpers``, the balancer's hook),
``onfabric`` puts it all on a ``vfab.testbed`` fabric, ``demo`` is ``make demo-helpers``.
"""

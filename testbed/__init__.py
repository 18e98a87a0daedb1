"""Test harness (DESIGN.md §7): local etcd, fake OpenFlow tables, Mininet topologies.

Tests import the testbed; the testbed never imports tests.
"""

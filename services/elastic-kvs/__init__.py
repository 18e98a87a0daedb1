"""elastic-KVS: a persistent key-value store whose key ranges split, merge, move and mirror live.

Keys are byte strings; the VID key of a key is a 24-bit hash of it
(``proto.vkey``), so each server owns the keys whose hash lies in its ranges.
Modules: ``proto`` (the request/reply wire format), ``store`` (durable SQLite
storage), ``envelope`` (the ZeroMQ control envelope), ``server`` (the data and
control loops), ``vfab.vid.state`` (split/merge/mirror/move), ``client`` (get/put/del
with retries), ``standard`` (the paper's select()-loop baseline over TCP).
"""

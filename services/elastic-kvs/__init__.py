"""elastic-KVS: a persistent key-value store whose key ranges split, merge, move and mirror live.

Keys are byte strings; the VID key of a key is a 24-bit hash of it
(``proto.vkey``), so each server owns the keys whose hash lies in its ranges.
Modules: ``proto`` (the request/reply wire format), ``store`` (durable SQLite
storage and the state records), ``backend`` (the KVS as a backend of vid-lib's
stateful-endpoint loop, ``vfab.vid.state``), ``server`` (wires them into the
loop), ``client`` (get/put/del with retries), ``loadgen`` (closed-loop load with
a recorded history), ``standard`` (the paper's select()-loop baseline over TCP).
"""

"""echo: the smallest vfab service, for tests and benchmarks.

``python -m vfab.services.echo server ...`` announces an endpoint, optionally
listens on key ranges, and answers every request with the JSON
``{"server": NAME, "key": KEY, "seq": SEQ}`` (KEY taken from the request's JSON,
SEQ the frame's sequence number).

``python -m vfab.services.echo client ...`` sends requests
``{"key": K, "seq": I, "t": TIME}`` to the VIDs of random keys, ping-pong or
at a fixed rate, never retries, and writes one record per request (including
late and duplicate replies) to a JSON file.  See ``--help`` of each command.
"""

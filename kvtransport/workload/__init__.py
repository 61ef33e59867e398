"""What the production commands (``kvtransport demo``, ``kvtransport bench``) and the test kit share: vLLM-shaped
KV caches and their presets (:mod:`.caches`, needs numpy), the two-process harness that runs a receiver and a
sender role each in a process of its own (:mod:`.harness`), and two "hosts" on one machine, network namespaces
joined by a veth pair (:mod:`.netns`, needs root). Nothing here is imported by the core's API."""

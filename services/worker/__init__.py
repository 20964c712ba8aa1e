"""Worker: the symmetric engine host of one node (scheduler core, KV block pools, engines, NATS shell)."""

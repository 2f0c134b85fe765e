"""Cache layer: which KV blocks are free (BlockPool) and which token prefixes they hold (PrefixCache)."""

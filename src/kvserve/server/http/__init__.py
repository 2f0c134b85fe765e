"""HTTP: who may call what, the request's id and body bounds, tenants, metrics, and the one error mapping."""

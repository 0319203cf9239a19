"""Multi-server runs: `compare` (kvserve against other servers), `scale` (a fleet's shared store
and routing), `chaos` (faults under load)."""

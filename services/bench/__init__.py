"""kvserve: services/bench. Entry modules, one per `kvserve bench` verb (main.py lists them),
beside lib/, workloads/ and sweeps/."""

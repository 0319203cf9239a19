"""The library the kvserve services use: config, model, engine, prefix store, bus, telemetry."""

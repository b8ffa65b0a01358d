"""What the control plane learns from the fleet: workers' /metrics scraped and turned into telemetry, what each serves, and which ext_proc replicas carry traffic."""

"""The system a bench measures: the worker fleet (simulated workers, or real ONNX ones with their CPU
quotas), the data planes in front of it (Envoy in each configuration, NGINX), and the readiness port of
children that speak no HTTP. Every live bench starts its stack through here."""

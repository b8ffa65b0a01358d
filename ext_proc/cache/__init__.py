"""The gateway cache: keys, the in-process level and the shared (Redis) level."""

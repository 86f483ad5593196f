"""The HTTP door under load: its overhead, aiperf and SDK loads, hostile inputs."""

"""GPU adapter: NVML through pynvml, and the simulated driver that stands in for it."""

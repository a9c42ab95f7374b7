"""Recorded answers from real hardware (NVML, sysfs, procfs), fed to the same parsing
code the agent runs on a real node."""

"""What a node has, one module per fact. Parsing is separate from reading so that
recorded samples (sysfs trees, mountinfo lines, NVML answers) test the same code."""

"""The recorded 8x H100 node lives in llmgw.sim.nvml, so an agent process can use it too."""

from llmgw.sim.nvml import DRIVER_VERSION, H100_BUS_IDS, H100_UUIDS, RecordedNvml  # noqa: F401

"""A simulated fleet: real agents on simulated hardware, serving simulated engines, from a
fleet file (docs/sim.md). `llmgw sim FLEET.toml`, `llmgw up --sim FLEET.toml`.

fleet.py      FLEET.toml: the format, its checks, groups expanded to nodes
hardware.py   what a simulated node's discovery is answered with
disk.py       the weights files and engine binaries simulated nodes hold
engines.py    every simulated engine served inside the simulator (an EngineLauncher)
simulator.py  one agent per node, kept as the file says while it changes
bare.py       bare nodes: the records an agent writes, without the agent (tests, benches)
fake_engine.py  a stand-in for llama-server and vLLM: their flags and HTTP API (also tests')
nvml.py       recorded NVML answers, read by the real discover_gpus
agent.py      the real agent on recorded hardware (`python -m llmgw.sim.agent`, tests')
tiny_gguf.py  a tiny GGUF that a real llama-server loads (tests'; needs the `test` extra)
"""

"""The `llmgw` command, one module per command (or group of them):

main.py        the group and its error handling
common.py      NATS options, opening the bus, running until a signal
up.py          llmgw up: one machine, everything
router.py      llmgw router (and the router options `up` shares)
controller.py  llmgw controller
place.py       llmgw place: desired.<model>, then what the controller decides
status.py      llmgw status
rollout.py     llmgw rollout status / undo: rollout.<model>
node.py        llmgw node cordon / uncordon / drain / taint / untaint: ops.<node>
catalog.py     llmgw catalog apply / ls
adapter.py     llmgw adapter add / ls / rm: LoRA adapters served as models (adapters.<id>)
agent.py       llmgw agent init / run
sim.py         llmgw sim: a simulated fleet (llmgw/sim/)
pki.py         llmgw pki: the fleet's CA and certificates
"""

from llmgw.cli.main import main

__all__ = ["main"]

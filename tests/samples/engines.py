"""What installed engines show the agent: `llama-server --version` output (on stderr),
the head of vllm's dist-info METADATA, and the console script pip writes for vllm."""

LLAMA_VERSION_CPU = """\
version: 9439 (47f6423ed)
built with cc (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0 for x86_64-linux-gnu
"""

# a CUDA build loads its backends (and says so) before printing the version
LLAMA_VERSION_CUDA = """\
ggml_cuda_init: GGML_CUDA_FORCE_MMQ:    no
ggml_cuda_init: GGML_CUDA_FORCE_CUBLAS: no
ggml_cuda_init: found 8 CUDA devices:
  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
  Device 1: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
  Device 2: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
  Device 3: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
  Device 4: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
  Device 5: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
  Device 6: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
  Device 7: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
load_backend: loaded CUDA backend from /opt/llama.cpp/build/bin/libggml-cuda.so
load_backend: loaded CPU backend from /opt/llama.cpp/build/bin/libggml-cpu-sapphirerapids.so
version: 9201 (b3c1f5d2a)
built with cc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0 for x86_64-linux-gnu
"""

# an archive unpacked without the shared libraries beside the binary
LLAMA_MISSING_LIBRARY = (
    "llama-server: error while loading shared libraries: libllama.so: "
    "cannot open shared object file: No such file or directory\n"
)

VLLM_METADATA = """\
Metadata-Version: 2.4
Name: vllm
Version: 0.11.0
Summary: A high-throughput and memory-efficient inference and serving engine for LLMs
Author: vLLM Team
License-Expression: Apache-2.0
Project-URL: Homepage, https://github.com/vllm-project/vllm
Project-URL: Documentation, https://docs.vllm.ai/en/latest/
Classifier: Programming Language :: Python :: 3.10
Classifier: Programming Language :: Python :: 3.11
Classifier: Programming Language :: Python :: 3.12
Requires-Python: <3.14,>=3.10
Description-Content-Type: text/markdown
License-File: LICENSE
Requires-Dist: regex
Requires-Dist: cachetools
Requires-Dist: torch==2.8.0
Provides-Extra: tensorizer
Requires-Dist: tensorizer==2.10.1; extra == "tensorizer"
Dynamic: license-file

<p align="center">vLLM</p>

Version: 0.0.0 (a line in the description, not the header)
"""

# what pip writes for the `vllm` entry point; {python} is the venv's interpreter
VLLM_CONSOLE_SCRIPT = """\
#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from vllm.entrypoints.cli.main import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""

# pip's trampoline when the interpreter path is too long or has spaces for a shebang
VLLM_CONSOLE_SCRIPT_SH = """\
#!/bin/sh
'''exec' "{python}" "$0" "$@"
' '''
# -*- coding: utf-8 -*-
import re
import sys
from vllm.entrypoints.cli.main import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""

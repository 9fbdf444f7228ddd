"""Per-leaf gradient comparison, compiled vs eager, on CUDA in float32 (a diagnostic, not a test).

    python tests/bench/gpu_grad_check.py [inductor|aot_eager] [regions|noregions]
"""
import sys

import torch

if len(sys.argv) > 2 and sys.argv[2] == "noregions":
    torch.compiler.nested_compile_region = lambda fn: fn      # before kimi is imported
sys.path.insert(0, "tests")
import kimi  # noqa: E402
from helpers import rel_err, tiny  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
cfg = tiny(index_topk=256, num_experts_per_token=8)
params = kimi.init_params(cfg, seed=0, dtype="float32", device="cuda")
named = [(n, p) for n, p in kimi.params.tree_items(params) if p.requires_grad]
ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
backend = kimi.Backend(moe="dense")
res = []
for fn in (torch.compile(kimi.forward, fullgraph=True, backend=sys.argv[1] if len(sys.argv) > 1 else "inductor"),
           kimi.forward):
    for _, p in named:
        p.grad = None
    fn(params, ids, cfg, backend).float().logsumexp(-1).mean().backward()
    res.append([None if p.grad is None else p.grad.clone() for _, p in named])
bad = [(n, round(rel_err(a, b), 4)) for (n, _), a, b in zip(named, *res)
       if a is not None and b is not None and rel_err(a, b) > 1e-4]
print(sys.argv[1:], "leaves with rel err > 1e-4:", len(bad), [b for b in bad if "layers." in b[0]][-8:], flush=True)

import sys, time, torch
sys.path.insert(0, "benchmarks")
import bench_layer_saves as b
from torch.profiler import profile, ProfilerActivity
shape = sys.argv[1]
for variant in ("compiled_projections", "compiled"):
    torch._dynamo.reset()
    layer, rotary, hidden = b.build_layer(shape, torch.device("cuda"))
    x = torch.randn(1, 8192, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary(x, torch.arange(8192, device="cuda")[None])
    fwd = b.layer_call(layer, variant, "inductor")
    def step():
        with torch.autocast("cuda", torch.bfloat16):
            out = fwd(x, position_embeddings=(cos, sin), attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    for _ in range(3): step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20): step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 20 * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5): step()
        torch.cuda.synchronize()
    ev = p.key_averages()
    gpu = sum(e.self_device_time_total for e in ev) / 5 / 1e3
    print(f"== {shape} {variant}: wall {wall:.2f} ms, GPU kernels {gpu:.2f} ms per fwd+bwd")
    print(ev.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))

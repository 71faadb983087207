// A compute-bound kernel for `kvoffload bench --contend`: it stands in for the
// model's kernels while copies run, so that the sweep can measure what each
// copy strategy costs the model (its slowdown) and what the model costs the
// copies (their rate under contention). Not used by the engine itself.
//
// Every thread runs `iters` rounds of four independent FMA chains in
// registers (no memory traffic but one store at the end), so the kernel's
// time is set by SM issue slots alone.

extern "C" __global__ void __launch_bounds__(256) kv_bench_burn(float* out, unsigned iters) {
    const unsigned idx = blockIdx.x * blockDim.x + threadIdx.x;
    float x0 = 1e-3f * threadIdx.x, x1 = x0 + 1.0f, x2 = x0 + 2.0f, x3 = x0 + 3.0f;
    const float b = 0.9999f, c = 1e-4f;
    for (unsigned i = 0; i < iters; ++i) {
        x0 = fmaf(x0, b, c);
        x1 = fmaf(x1, b, c);
        x2 = fmaf(x2, b, c);
        x3 = fmaf(x3, b, c);
    }
    out[idx] = x0 + x1 + x2 + x3;
}

// The GPU half of the content fingerprint (csrc/platform/fingerprint.h has the definition and
// the CPU half). Not built with the library: tools/generate_fingerprint_ptx.sh turns it into
// PTX once, at development time, and the driver compiles that PTX at run time, so neither the
// build nor a user needs a CUDA toolkit, and one text serves CUDA 12 and 13 drivers.
//
// One thread block per segment of 256 blocks of 1 KiB: each warp computes the NH sums of a
// block in its 4 lanes, the block's 8 warps in turn; then 32 threads per lane evaluate the
// polynomial over 8 blocks each, and one thread per lane joins the 32 parts.
typedef unsigned int u32;
typedef unsigned long long u64;

#define LANES 4
#define BLOCK_WORDS 256
#define SEGMENT_BLOCKS 256
#define PRIME 0x1FFFFFFFFFFFFFFFull  // 2^61 - 1

__device__ __forceinline__ u64 reduce(u64 x) {  // x < 2^64 -> x mod p (lazy: < 2p)
  return (x & PRIME) + (x >> 61);
}
__device__ __forceinline__ u64 mod_p(u64 x) {
  x = reduce(x);
  return x >= PRIME ? x - PRIME : x;
}
__device__ __forceinline__ u64 mul_mod(u64 a, u64 b) {  // a, b < p
  const u64 lo = a * b, hi = __umul64hi(a, b);
  return mod_p((lo & PRIME) + ((lo >> 61) | (hi << 3)));
}
__device__ __forceinline__ u64 pow_mod(u64 r, u32 e) {
  u64 result = 1;
  while (e) {
    if (e & 1) result = mul_mod(result, r);
    r = mul_mod(r, r);
    e >>= 1;
  }
  return result;
}
// h <- (h + e) * r: one step of the polynomial over the 32-bit halves of the NH sums.
__device__ __forceinline__ u64 horner(u64 h, u64 e, u64 r) { return mul_mod(mod_p(h + e), r); }

extern "C" __global__ void __launch_bounds__(256) tmsl_fingerprint_segments(
    const uint4* __restrict__ data, u64 blocks, const u32* __restrict__ nh_key,
    const u64* __restrict__ poly_key, u64* __restrict__ out) {
  __shared__ u64 sums[SEGMENT_BLOCKS][LANES];
  __shared__ u64 parts[LANES][32];
  __shared__ u32 part_lengths[32];
  const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const u64 first = (u64)blockIdx.x * SEGMENT_BLOCKS;
  const u32 count = (u32)min((u64)SEGMENT_BLOCKS, blocks - first);

  // This thread's 8 words of every block, paired (2i, 2i+1), and the key words they meet.
  u32 key[LANES][8];
  for (int j = 0; j < LANES; ++j)
    for (int w = 0; w < 8; ++w) key[j][w] = nh_key[j * BLOCK_WORDS + lane * 8 + w];

  for (u32 b = warp; b < count; b += 8) {
    const uint4* p = data + (first + b) * (BLOCK_WORDS / 4) + lane * 2;
    const uint4 x = p[0], y = p[1];
    const u32 m[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
    u64 s[LANES];
    for (int j = 0; j < LANES; ++j) {
      s[j] = 0;
      for (int w = 0; w < 8; w += 2) s[j] += (u64)(u32)(m[w] + key[j][w]) * (u64)(u32)(m[w + 1] + key[j][w + 1]);
    }
    for (int offset = 16; offset > 0; offset /= 2)
      for (int j = 0; j < LANES; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], offset);
    if (lane == 0)
      for (int j = 0; j < LANES; ++j) sums[b][j] = s[j];
  }
  __syncthreads();

  if (threadIdx.x < LANES * 32) {
    const u32 j = threadIdx.x / 32, part = threadIdx.x % 32;
    const u64 r = poly_key[j];
    const u32 begin = min(part * 8, count), end = min(part * 8 + 8, count);
    u64 h = 0;
    for (u32 b = begin; b < end; ++b) {
      h = horner(h, sums[b][j] & 0xFFFFFFFFull, r);
      h = horner(h, sums[b][j] >> 32, r);
    }
    parts[j][part] = h;
    if (j == 0) part_lengths[part] = 2 * (end - begin);
  }
  __syncthreads();
  if (threadIdx.x < LANES) {
    const u32 j = threadIdx.x;
    const u64 r = poly_key[j], r16 = pow_mod(r, 16);
    u64 v = 0;
    for (int part = 0; part < 32; ++part) {
      const u32 length = part_lengths[part];
      if (length == 0) break;
      v = mod_p(mul_mod(v, length == 16 ? r16 : pow_mod(r, length)) + parts[j][part]);
    }
    out[(u64)blockIdx.x * LANES + j] = v;
  }
}

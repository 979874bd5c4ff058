/* Every loop of the fingerprint kernel (the level chosen as at import, UNICKPT_FP_SIMD honoured)
 * against the plain C one, on 20000 random spans (group position l0, length n, buffer address
 * 0..7 bytes past an aligned one; random and all-0xFF limbs), for both limb widths. Built with
 * -I tests/data/fp_harness -include unickpt/spec/_fp2kernel.c; exits 1 on any mismatch. */
#include <stdio.h>
int main(void) {
    choose_loops();
    build_tables();
    static uint8_t buf[4096 + 64] __attribute__((aligned(64)));
    uint64_t x = 12345;
    int bad = 0, runs = 0;
    for (int trial = 0; trial < 20000; trial++) {
        for (size_t i = 0; i < sizeof buf; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            buf[i] = (uint8_t)(x >> 56);
        }
        if (trial % 7 == 0) memset(buf, 255, sizeof buf);
        uint32_t l0 = (uint32_t)(x % G), n = (uint32_t)((x >> 20) % (G - l0 + 1)), shift = (uint32_t)((x >> 40) % 8);
        for (int lb = 1; lb <= 2; lb++) {
            uint64_t a1 = 0, a2 = 0, b1 = 0, b2 = 0;
            (lb == 1 ? span_scalar_u8 : span_scalar_u16)(buf + shift, l0, n, &a1, &a2);
            SPAN[lb - 1](buf + shift, l0, n, &b1, &b2);
            runs++;
            if ((a1 != b1 || a2 != b2) && bad++ < 5) printf("MISMATCH lb=%d l0=%u n=%u\n", lb, l0, n);
        }
    }
    printf("%s: %d spans, %d mismatches\n", simd_name, runs, bad);
    return bad != 0;
}

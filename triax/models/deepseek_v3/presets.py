"""model.arch=deepseek_v3's presets: one small enough for a CPU, then the published shapes (for
`triax plan`; "vocab_size" is the vocabulary plan assumes)."""

PRESETS: dict[str, dict] = {
    "deepseek-v3-debug": dict(arch="deepseek_v3", n_layer=4, n_head=4, n_embd=128, intermediate_size=352,
                              q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              num_experts=8, experts_per_token=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, router_scoring="sigmoid", router_groups=4,
                              router_topk_groups=2, routed_scaling_factor=2.5, first_dense_layers=1),
    # DeepSeek-V3 (and R1, Kimi K2's shape but for its 384 experts): 671B parameters, 37B active.
    "deepseek-v3": dict(arch="deepseek_v3", n_layer=61, n_head=128, n_embd=7168, intermediate_size=18432,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, num_experts=256, experts_per_token=8, moe_intermediate_size=2048,
                        shared_expert_intermediate_size=2048, router_scoring="sigmoid", router_groups=8,
                        router_topk_groups=4, routed_scaling_factor=2.5, first_dense_layers=3, norm_eps=1e-6,
                        rope_scaling="yarn", rope_factor=40.0, rope_original_context=4096, vocab_size=129280),
    # Moonlight-16B-A3B (Moonshot AI): no query latent, 64 experts in one group, 16B parameters, 3B active.
    "moonlight-16b-a3b": dict(arch="deepseek_v3", n_layer=27, n_head=16, n_embd=2048, intermediate_size=11264,
                              q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, num_experts=64, experts_per_token=6, moe_intermediate_size=1408,
                              shared_expert_intermediate_size=2816, router_scoring="sigmoid", router_groups=1,
                              router_topk_groups=1, routed_scaling_factor=2.446, first_dense_layers=1,
                              rope_theta=50000.0, norm_eps=1e-5, vocab_size=163840),
}

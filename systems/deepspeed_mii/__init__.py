"""DeepSpeed baselines: DeepSpeed-MII FastGen (`engine=mii`) and ZeRO-Inference (`engine=zero_offload`).

Heavy dependencies (deepspeed, deepspeed-mii) are imported only inside the adapter's ``load``.
"""

"""The worker side: what runs the model on one device (one tensor-parallel rank). The model runner (inputs from
plain scheduled records, forward, CUDA graphs), its KV cache and swap space, the weight loader, the sampler."""

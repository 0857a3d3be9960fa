"""Moving blocks between the engine's KV and the host pool: the transfer workers, the CPU and CUDA
copiers and their strategies, the engine's KV mapped into the daemon, its order words, and the
SIGBUS guard over client memory."""

"""This host's own calls: the CUDA runtime, another process's memory
(process_vm_readv), timer slack, and which process holds a socket's other end."""

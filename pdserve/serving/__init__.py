"""What every serving process shares: the engine thread, gRPC server plumbing, status codes."""

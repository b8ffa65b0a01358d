"""ext_proc's gRPC fronts: grpcio's and the native one (gRPC C++), and grpc's settings."""

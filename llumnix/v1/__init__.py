"""Generated protobuf/gRPC stubs for the versioned wire format `llumnix.v1` (sources in proto/;
regenerate with scripts/gen_proto.sh)."""

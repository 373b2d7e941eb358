"""Generated from protos/kvstash/v1 by `make protos`. Do not edit."""

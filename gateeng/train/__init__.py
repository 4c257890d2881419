"""The trainer's side: a policy whose forward is the reference (bit-equal to VERIFIED
logprobs) and whose backward is ordinary torch arithmetic."""
from gateeng.train.policy import Policy

__all__ = ["Policy"]

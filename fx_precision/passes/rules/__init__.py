"""The findings: one function per FXP code, in the order they are reported."""

"""Tests for core.tangent."""

"""Test helpers that ship with the library: conformance suites, audit, simulation."""

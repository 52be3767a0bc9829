//! Helpers for the multi-process integration tests: start real `yatt-node` processes on
//! loopback, wait for conditions by polling with a deadline, and clean up.

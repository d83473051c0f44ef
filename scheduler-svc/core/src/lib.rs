//! Ferry's pure scheduling core: no I/O, no clock. It lands with the scheduling-core issue.

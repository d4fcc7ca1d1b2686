//! offload-candle

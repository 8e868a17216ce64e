mod calibration;
mod loaders;
mod models;

mod calibration;
mod cli;
mod cost;
mod loaders;
mod models;
mod tidy;
